"""Model tests: config parsing, checkpoint loading, and paged-model parity with transformers."""
