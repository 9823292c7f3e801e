from jaxtrain.cli import main

raise SystemExit(main())
