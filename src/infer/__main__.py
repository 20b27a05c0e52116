from infer.cli import main

raise SystemExit(main())
