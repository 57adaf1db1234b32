"""Repository-wide pytest setup.

Under ``--import-mode=importlib`` a test module is named after its path (``packages.inference.tests.
test_server``). Processes started with multiprocessing's ``spawn`` re-import the module that holds their
target function by that name, so the repository root must be on ``sys.path`` (spawned children inherit
the parent's ``sys.path``); ``packages`` then resolves as a namespace package.
"""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
