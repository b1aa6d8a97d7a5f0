# Make `import f8dist` resolve to this checkout (also in git worktrees) before any installed copy.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
