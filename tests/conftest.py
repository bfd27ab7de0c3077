import os
import sys

os.environ.setdefault("ASCENDSPEED_DEVICE", "cpu")
sys.path.insert(0, os.path.dirname(__file__))
