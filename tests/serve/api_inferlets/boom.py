"""Raises: its run must fail with a 500-class error carrying the message, and the server stay up."""

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    raise ValueError("boom: the inferlet gave up")
