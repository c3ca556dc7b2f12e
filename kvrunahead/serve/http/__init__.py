"""The server's HTTP face: the FastAPI app and its routes (``app``), the uvicorn server (``server``), a request's
token stream (``streams``), its inputs and answers (``inputs``, ``responses``, ``ask_shapes``), the OpenAI wire
shapes (``protocol``) and the Prometheus metrics (``metrics``)."""
