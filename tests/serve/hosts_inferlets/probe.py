"""Reports its host's limits and environment; with hog, tries to allocate that many bytes."""

import os
import resource

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    if args.get("hog"):
        block = bytearray(int(args["hog"]))
        return {"allocated": len(block)}
    return {
        "address_space": resource.getrlimit(resource.RLIMIT_AS)[0],
        "cpu": resource.getrlimit(resource.RLIMIT_CPU)[0],
        "open_files": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "env": sorted(os.environ),
        "model": inferlet.model().name,
    }
