"""Loading models: the record a command reads a model through (config.json and the checkpoint's tables read once),
built-in names and dtypes, checks on a checkpoint's files, its key layouts read into place, and the experts' weights
a build converts."""
