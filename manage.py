#!/usr/bin/env python
import os
import secrets
import sys

# What asks for help: no command, `help [COMMAND]`, or any command's --help.
HELP = ("help", "--help", "-h")


def asks_for_help(argv: list[str]) -> bool:
    return len(argv) < 2 or argv[1] in HELP or any(arg in ("--help", "-h") for arg in argv[2:])


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "batchweb.settings")
    from batchweb.secret_key import SECRET_KEY_FILE

    if asks_for_help(sys.argv) and not os.environ.get("SECRET_KEY") \
            and not SECRET_KEY_FILE.exists():
        # In a fresh checkout (no key yet) the settings refuse to load, and Django would
        # then list only its own commands. Help signs nothing: a throwaway key lets it list
        # batchweb's commands too, and the note says what the others need.
        os.environ["SECRET_KEY"] = secrets.token_urlsafe(50)
        sys.stderr.write(f"Note: SECRET_KEY is not set and {SECRET_KEY_FILE} does not exist: "
                         f"`make install` writes one (or set SECRET_KEY); until then every "
                         f"command but help refuses to start.\n\n")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
