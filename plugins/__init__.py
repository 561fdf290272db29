"""plait's built-in plugins, registered through the ``plait`` entry-point group like any third-party plugin."""
