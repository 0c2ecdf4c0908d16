"""``python -m llama_index_crag.cli``: the same as ``llama-crag`` (the server's worker test starts it so)."""

import sys

from llama_index_crag.cli import main

sys.exit(main())
