"""Emits once, then waits ``seconds`` without blocking its host's event loop (its heartbeats go on), and returns."""

import asyncio

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    inferlet.emit("napping")
    await asyncio.sleep(float(args.get("seconds", 1.0)))
    return {"slept": float(args.get("seconds", 1.0))}
