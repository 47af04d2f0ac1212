import sys

from pipecore.tools.cli import main

sys.exit(main())
