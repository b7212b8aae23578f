import sys

from index_builder.cli import main

sys.exit(main())
