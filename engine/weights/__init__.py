"""Every way weights arrive in a served model, and the one check each makes first: docs/layout.md lists the files."""
