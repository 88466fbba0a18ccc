"""The shared runtime library: checkpoints, bundles, tokenizer, models, KV cache, scheduler, engine."""
