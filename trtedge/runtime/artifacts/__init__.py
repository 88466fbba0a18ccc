"""What is on disk: checkpoint resolution, GGUF, quantized tensors, build profiles, bundles and their cache."""
