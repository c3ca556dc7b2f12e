"""The transformers-model helpers: loading, the RoPE extension, what a model's layers cache, our attention put into
its attention interface, and one rank's forward."""
