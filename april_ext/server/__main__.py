"""`python -m april_ext.server ...` = `april-ext serve ...` (the SGLang launcher's stand-in module)."""

import sys

from april_ext.server.cli import main

sys.exit(main())
