"""The gateway's in-process jobs around the request path: the batch tier (files, batches) and capacity planning."""
