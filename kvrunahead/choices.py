"""The names a run chooses among, torch-free so that every CLI's ``--help`` starts fast."""

DEFAULT_MODEL = "smollm2-135m"
TRANSPORTS = ("torch", "mpi")
# How an all-gather mode gathers: the library's collective, or a ring of the same point-to-point transfers the
# KV chain uses (p-1 steps, each rank passing one block to its successor). gloo's collective moves bytes several
# times slower than its point-to-point over loopback, and MPI's is no faster (experiments/allgather_vs_p2p);
# NCCL's all-gather is as fast as its point-to-point, so "auto" keeps it there.
ALLGATHERS = ("auto", "native", "p2p")
# kvr's attention: split (prefix block in full, own block causally, merged by log-sum-exp) or masked (the
# model's SDPA under the offset causal mask, the paper's); auto picks split where the model allows it.
KVR_ATTENTIONS = ("auto", "masked", "split")
DTYPES = ("float32", "bfloat16", "float16")
# auto: what the hardware is fast in (bfloat16 on a CPU with avx512_bf16 or AMX whose bfloat16 GEMMs were timed faster
# than float32's, the model's 16-bit dtype on a GPU)
DTYPE_CHOICES = ("auto", *DTYPES)
# Where the tokens after the first are decoded: on the last rank with the whole cache gathered there (the chain
# leaves it there), or KV-cache parallel (decode/kvp.py: each rank keeps its part, attention merged per layer).
DECODES = ("gathered", "kvp")
# The server may also choose per request: KVP where the cost model predicts its decode step faster.
SERVE_DECODES = ("auto", *DECODES)
DEVICES = ("auto", "cpu", "cuda")
# Which waiting prefill the server runs next (serve/scheduler.py): first come, first served, or Medha's
# length-aware relative slack.
SCHEDULES = ("fcfs", "lars")
# The CPU kernels (kvrunahead/kernels, model/linears.py): the choices and the environment variables that carry them
# to the ranks a tool starts.
ATTENTION_KERNELS = ("auto", "ours", "torch")
ATTENTION_KERNEL_ENV = "KVR_ATTENTION_KERNEL"
LINEARS = ("auto", "onednn", "torch")
LINEARS_ENV = "KVR_LINEARS"
