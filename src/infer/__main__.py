import os
import signal


def _interrupted(signum: int, frame: object) -> None:  # Ctrl-C before `main` takes over: one line, 130
    os.write(2, b"infer: interrupted\n")
    os._exit(130)


signal.signal(signal.SIGINT, _interrupted)

from infer.cli import main  # noqa: E402

raise SystemExit(main())
