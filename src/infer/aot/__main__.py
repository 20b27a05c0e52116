"""``python -m infer.aot REQUEST``: the worker that builds one package (`infer.aot.worker`)."""

import sys

from infer.aot.worker import main

sys.exit(main(sys.argv[1:]))
