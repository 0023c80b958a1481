"""The plane tests share the transport tests' helper modules (``rawpeer``, ``cluster_ops``...),
which live one folder up: put it on the import path, as pytest does for a test's own folder."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
