"""The Python side of the C++ executor (`pipecore._C`): its constants, the program it runs, and the
small communication service that the runtime and the training modules share."""
