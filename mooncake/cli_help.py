"""The --help formatter every command uses: descriptions keep their line breaks, and each
option's default is shown beside its help."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless there is nothing to show (None, a flag's False) or the
    help text already says where its default comes from."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, []) or "default" in text:
            return action.help
        return super()._get_help_string(action)
