"""The bottom layer: parameters, errors, limits, config and the messages between processes."""
