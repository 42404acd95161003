"""The `segcache` command line."""


def main(argv=None):
    raise SystemExit("segcache: the CLI is not built yet")
