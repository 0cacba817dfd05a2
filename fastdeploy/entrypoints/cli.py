"""`fastdeploy` command line: `fastdeploy serve [MODEL] [options]`."""

from __future__ import annotations

import sys


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print("usage: fastdeploy serve [MODEL] [options]   (fastdeploy serve --help for the options)")
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    command, rest = sys.argv[1], sys.argv[2:]
    if command != "serve":
        print(f"fastdeploy: unknown command {command!r}; try 'fastdeploy serve --help'", file=sys.stderr)
        sys.exit(2)
    # Imported here, not at the top: the engine and worker processes are spawned, and a spawned
    # child imports the parent's main module again, this one included; the HTTP stack is the
    # API server's alone.
    from fastdeploy.entrypoints.openai.api_server import main as serve_main

    serve_main(rest)


if __name__ == "__main__":
    main()
