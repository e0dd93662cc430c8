"""`cli_flags`: a dict of command-line options -> the argv list a service runs with.

The roles keep each command's options as one dict (`--name` -> value); an option that is
null or "" is left out, so the command's own default (mooncake/defaults.py) applies and the
playbook never restates it. A list value repeats the option; a value of true is a bare flag.
"""

from __future__ import annotations


def cli_flags(options):
    argv = []
    for name, value in options.items():
        values = value if isinstance(value, list) else [value]
        for one in values:
            if one is None or one is False or one == "":
                continue
            argv.append(f"--{name}")
            if one is not True:
                argv.append(str(one))
    return argv


class FilterModule:
    def filters(self):
        return {"cli_flags": cli_flags}
