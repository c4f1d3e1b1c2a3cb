"""``python -m engine.swift_rollout plugin|site``: the path to give ``--external_plugins``, or the folder to put on
``PYTHONPATH``."""

import sys

from engine.swift_rollout import PLUGIN_FILE, SITE_DIR


def main(argv: list[str]) -> int:
    if argv not in (["plugin"], ["site"]):
        print("usage: python -m engine.swift_rollout plugin|site\n"
              "  plugin  the file for swift rollout --external_plugins\n"
              "  site    the folder for PYTHONPATH where --external_plugins is unavailable", file=sys.stderr)
        return 2
    print(PLUGIN_FILE if argv == ["plugin"] else SITE_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
