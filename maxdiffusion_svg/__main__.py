"""Entry point for ``python -m maxdiffusion_svg``."""

import sys

from maxdiffusion_svg.cli.main import main

if __name__ == "__main__":
  sys.exit(main())
