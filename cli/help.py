"""How `slotserve ... --help` is laid out: every option's help ends with its default, so no
command needs to repeat it by hand (and none can forget it)."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help. Left out where it would say nothing: no
    default (None), an on/off flag (a bool), an empty list, or a help that says "(default..."
    itself (one naming an environment variable, say, whose value must not be printed)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or default == []
            or "(default" in text
        ):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class RawDescriptionDefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """The same, for a command whose description is laid out by hand (an example file)."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults unless the command picks another formatter."""

    def __init__(self, *args, formatter_class: type[argparse.HelpFormatter] = DefaultsHelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
