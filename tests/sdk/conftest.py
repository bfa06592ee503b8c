import sys
from pathlib import Path

# The SDK must import without the engine; put sdk/ first so `inferlet` resolves to this tree.
sys.path.insert(0, str(Path(__file__).parents[2] / "sdk"))
