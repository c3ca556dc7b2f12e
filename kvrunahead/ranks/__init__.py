"""The ranks: how they start (``launcher``: torchrun, mpirun or our own spawn; ``supervise``: the children's
lifetime), how a rank is set up once for every way in (``setup``: device, dtype, threads, model, transport), how
they talk (``transport``: point to point and all-gather; ``mesh``: the TP groups and their collectives) and what a
rank reports of its run (``stats``)."""
