"""``python -m april_ext.cli``: the ``april-ext`` command (torchrun launches ranks this way)."""

import sys

from april_ext.cli import main

sys.exit(main())
