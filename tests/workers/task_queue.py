"""Enqueue django.tasks jobs on the database backend, or report their results.

Usage: task_queue.py enqueue CUSTOMER COUNT LOG WORK
       task_queue.py results ID...

Runs with DJANGO_SETTINGS_MODULE=tests.settings_tasks (Django 6.0+ and
django-tasks-db). ``enqueue`` queues COUNT runs of
``tests.django_task_jobs.build_report`` and reports ``enqueued`` with their
result ids; ``results`` reports ``results`` with the status of each id, as the
backend tells it.
"""

import sys

import django

django.setup()

from support import emit  # noqa: E402

from tests.django_task_jobs import build_report  # noqa: E402


def main(command: str, *args: str) -> None:
    if command == "enqueue":
        customer, count, log, work = int(args[0]), int(args[1]), args[2], float(args[3])
        ids = [str(build_report.enqueue(customer, log, work).id) for _ in range(count)]
        emit("enqueued", ids=ids)
    elif command == "results":
        emit("results", statuses={i: str(build_report.get_result(i).status) for i in args})
    else:
        emit("error", message=f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
