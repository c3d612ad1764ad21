import sys
from pathlib import Path

# Let tests import the shared builders as ``from builders import ...``.
sys.path.insert(0, str(Path(__file__).parent))
