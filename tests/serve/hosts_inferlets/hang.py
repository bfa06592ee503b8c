"""Emits once, then blocks its host's event loop forever: only missed heartbeats can reveal it."""

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    inferlet.emit("spinning")
    while True:
        pass
