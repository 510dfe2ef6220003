"""Using a trained model: loading any checkpoint for inference, generation with
a KV cache and the REST server, and zero-shot evaluation."""
