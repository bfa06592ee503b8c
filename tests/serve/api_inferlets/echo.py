"""Emits two pieces of text and returns its arguments: the custom-inferlet route's happy path."""

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    inferlet.emit("hello ")
    inferlet.emit("world")
    return {"echo": args}
