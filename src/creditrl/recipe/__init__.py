"""Config to components, in one room: ``resolve`` checks a config against everything the library
declares and completes it (before any model or data loads); ``build`` turns the resolved config
into the task, the device, the policy and the loss; ``reference`` documents every option
(docs/config.md, ``--help``). The trainer, ``creditrl eval``, ``creditrl diagnose`` and the
experiments all go through here, so each builds exactly what ``creditrl train`` builds."""
