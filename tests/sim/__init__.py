"""Tests that simulate many ranks in one process: the suite's distributed correctness (X under
FSDP2 / TP / EP / delayed sync equals one device, exact byte counts), against one device, in
seconds, on meshes a 2-core machine cannot launch too. The torchrun programs of
tests/distributed/ run here too, unchanged, on threads (tests/sim/programs.py, [Note: one rank at
a time]). Each parallelism and each float8 wire path keeps one real torchrun/gloo smoke in
tests/distributed/ (docs/tests.md lists which claim lives where).

[Note: simulating ranks in one process]
Two simulators, each fitting other tests:

* ``run_threads`` (tests/sim/threads.py): one thread per rank on torch's threaded process group.
  Each rank runs f8dist's real code on plain tensors, FSDP2 and DTensor included, and only the
  collectives are simulated (in memory; functional ones too). So it runs whatever torchrun runs:
  FSDP2 (its float8 all-gather hooks), 2-D FSDP x TP with sequence parallelism, and rank-divergent
  programs such as expert parallelism with uneven token slices and empty experts. Cost: every rank
  computes its own program (8 ranks: 8 times one rank's work, serialized by the GIL), so shapes
  stay small.
* ``local_world`` (tests/sim/local.py): ``torch.distributed._local_tensor.LocalTensorMode`` over
  the fake process group runs ONE program whose tensors are ``LocalTensor``s holding every rank's
  value: one program, each op run once per rank (16 ranks: about a second a test; 64 cost about
  10 s per DTensor op, which computes every rank's mesh coordinate), for programs where every rank
  has the same shapes and no float8 tensor is redistributed:
  ``cast_to_float8`` of a sharded DTensor (its amax reduced by DTensor, a Float8Tensor holding
  LocalTensors comes back) and the placement rules. It cannot run (torch 2.13):

  - FSDP2, even in bf16: it frees an unsharded parameter with ``untyped_storage().resize_(0)``,
    and a LocalTensor has no such storage ("invalid python storage");
  - a Float8Tensor that DTensor redistributes (the float8 sequence-parallel all-gather): DTensor's
    per-rank helpers (``maybe_run_for_local_tensor``, e.g. the padding before a Shard ->
    Replicate all-gather) map LocalTensor arguments to one rank's value but take a Float8Tensor
    holding LocalTensors as one value, and wrap the per-rank results into a LocalTensor of
    Float8Tensors that nothing downstream handles. The nesting torch expects (the DTensor's local
    tensor IS the LocalTensor) would need the cast to build one Float8Tensor per simulated rank:
    simulator code in f8dist's one cast, for tests only, so f8dist does not do it;
  - rank-divergent programs: its per-rank sizes are ``LocalIntNode`` SymInts and a Python branch
    on a size (an empty token group, the grouped gemm padding its groups to 16 rows) is evaluated
    once for all ranks (``LocalIntNode.eq`` is "equal on every rank"; ``<`` raises where ranks
    disagree; slicing a tensor of a per-rank size fails).

``f8dist.testing.count_collectives`` counts on both: per thread on the threaded group, once per
simulated collective under LocalTensorMode, with the ranks of the group each call went over.
"""
