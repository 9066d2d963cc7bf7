"""Built-in offline tasks with verifiable rewards, by name."""
from rhymerl.tasks.arith import ArithTask
from rhymerl.tasks.base import Problem, Task
from rhymerl.tasks.chat_sums import ChatSumsTask
from rhymerl.tasks.countdown import CountdownTask

TASKS: dict[str, type[Task]] = {"arith": ArithTask, "countdown": CountdownTask, "chat_sums": ChatSumsTask}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    return TASKS[name]()


__all__ = ["TASKS", "ArithTask", "ChatSumsTask", "CountdownTask", "Problem", "Task", "get_task"]
