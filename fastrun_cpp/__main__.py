import sys

from fastrun_cpp.cli import main

sys.exit(main())
