import sys
from pathlib import Path

# The job launcher (cluster.py) is a helper module of these tests, not a test.
sys.path.insert(0, str(Path(__file__).parent))
