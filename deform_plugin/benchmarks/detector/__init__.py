"""The whole-detector benchmarks and profile.

Fixed-size rows (``tools/benchmark.py``): rows (:mod:`.rows`), config edits and image size (:mod:`.configs`),
synthetic batches (:mod:`.synthetic`), timing (:mod:`.timing`), profiling (:mod:`.profiling`), stock rows in a
child process (:mod:`.children`), the report (:mod:`.report`) and the command line (:mod:`.run`).

The user's training path (``tools/benchmark_train.py``): rows through the training scripts and mmengine's Runner
(:mod:`.user_path`), a synthetic COCO-like image source (:mod:`.coco_source`), the timing hook
(:mod:`.iteration_timer`), mmdet's own training script for stock rows (:mod:`.stock_train`) and the report
(:mod:`.train_report`).

AP parity over seeds (``tools/ap_parity.py``): the command line (:mod:`.ap_parity`), each run's derived config and
the data (:mod:`.ap_parity_config`), the runs, their pace and schedule (:mod:`.ap_parity_study`), the initial weights
built by stock mmdet (:mod:`.initial_weights`), the runs' hook (time limit, pacing, schedule, progress, evaluations:
:mod:`.parity_hook`), the logged curves (:mod:`.loss_curves`) and the report (:mod:`.ap_parity_report`).

No module here imports the rest of deform_plugin at module level: stock rows run these modules in a process that
never does (:mod:`deform_plugin.benchmarks.stock_process`).
"""
