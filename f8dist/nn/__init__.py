"""The float8 modules (Float8Linear, grouped experts, SwiGLU) and the conversion that swaps them in. Imports the layers below (config, core, policy)."""
