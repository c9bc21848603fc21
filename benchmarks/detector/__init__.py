"""The whole-detector benchmark and profile: rows (:mod:`.rows`), config edits and image size (:mod:`.configs`),
synthetic batches (:mod:`.synthetic`), timing (:mod:`.timing`), profiling (:mod:`.profiling`), stock rows in a
child process (:mod:`.children`), the report (:mod:`.report`) and the command line (:mod:`.run`).

No module here imports deform_plugin at module level: stock rows run these modules in a process that never does.
"""
