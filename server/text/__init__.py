"""Text in and out of token ids: the tokenizer with its chat template, and incremental
detokenisation with stop strings. Torch-free, so the network edge can import it cheaply."""
