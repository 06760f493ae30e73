"""Training a C2C fuser: distillation task and loss, example sets, trainer, `cortexstream train c2c`."""
