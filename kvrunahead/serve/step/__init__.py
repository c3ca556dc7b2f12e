"""What every rank runs in a step: the plan the front engine broadcasts (``plans``: segments and decode rows),
its segments' ways (``segments``) and the links between ranks (``links``), the decode rows (``rows``,
``batch_decode``), the rank's long-lived context (``rank``), the executor that runs a plan (``executor``) and the
worker loop of every rank behind the front one (``workers``)."""
