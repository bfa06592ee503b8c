"""`pie serve`: an HTTP front (FastAPI on uvicorn) over one engine and a pool of inferlet host processes.

host_pool.py (``HostPool``) spawns and supervises the hosts; host_launcher.py starts each one; inferlet_host.py is
the host process, which runs many inferlet runs as asyncio tasks over one engine connection; control.py is the
wire between them. This package's ``__init__`` imports nothing, so a host process loads none of the HTTP stack.
"""
