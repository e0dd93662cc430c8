"""The --help formatter every command uses: descriptions keep their line breaks, and each
option's default is shown beside its help."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless there is nothing to show (None, a flag's False) or the
    help text already says where its default comes from."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        # `is False`: 0 == False, and a default of 0 is worth showing.
        if action.default is None or action.default is False or action.default == [] or "default" in text:
            return action.help
        return super()._get_help_string(action)
