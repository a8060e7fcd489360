"""The engine: scheduler, KV management, model runner, sampler and the engine thread.

Import submodules directly (`server.engine.thread`, `server.engine.engine`); this package file
stays empty so that importing the torch-free parts never pulls in torch.
"""
