"""`python -m april_ext.server ...` = `april-ext serve ...` (the SGLang launcher's stand-in module). An entry
run by `python -m` belongs to the command line, the top layer, wherever it sits (tests/test_layering.py)."""

import sys

from april_ext.cli.serve import main

sys.exit(main())
